"""`gpt-fast serve`: an OpenAI-compatible HTTP server over a continuous batcher, with a chat page.

``openai_api`` checks request bodies and builds the API's responses; ``sse`` carries a request's events from the
batcher's thread to a response (server-sent events); ``app`` is the Starlette application (routes, keys, errors);
``server`` binds the socket, warms the engine up and runs uvicorn; ``static/index.html`` is the chat page.
"""
