"""tgserve.router: the HTTP front end (FastAPI + uvicorn). Never imports torch."""
