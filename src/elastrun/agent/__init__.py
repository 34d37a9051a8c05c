"""The elastic agent: rendezvous -> plan -> start -> watch -> restart / rescale / finish."""
