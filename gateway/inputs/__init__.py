"""A client's JSON checked into one transport-neutral ``GenerateRequest``: prompt, sampling, tools, grammars."""
