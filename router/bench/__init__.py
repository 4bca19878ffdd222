"""`tgserve bench`: a load generator for a running server, with the offline engine as a baseline."""
