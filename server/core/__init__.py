"""Plain-Python scheduling: requests, scheduler and block manager. Never imports torch."""
