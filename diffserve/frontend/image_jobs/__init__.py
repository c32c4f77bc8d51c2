"""Asynchronous image jobs (``Prefer: respond-async``) and their webhooks."""
