"""The OpenAI Videos API: asynchronous video jobs kept in SQLite, their MP4s on disk."""
