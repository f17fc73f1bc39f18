"""The `gpt-fast` command line: one click app, options checked into one `error:` line."""
