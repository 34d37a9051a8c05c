"""Worker processes: starting them, their log files and output relay, and stopping them."""
