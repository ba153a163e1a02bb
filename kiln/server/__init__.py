"""The OpenAI-compatible HTTP server over kiln's engine (`kiln.runtime`): `app.create_app` and `app.serve`."""
