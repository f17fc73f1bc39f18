"""Text: tokenizers, chat templates and the Jinja sandbox they run in, text streams and stop strings."""
