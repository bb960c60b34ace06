"""The OpenAI-compatible HTTP API of `specdec serve --http-port`: the routes (`api`), their JSON
(`openai_protocol`), chat templates (`chat`), errors, request limits and the uvicorn server.
Built on the serving core (`orchestrator.core`); Starlette and uvicorn load only with it."""
