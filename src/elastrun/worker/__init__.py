"""Worker-side helpers: code that runs inside training processes; imports only elastrun.core."""
