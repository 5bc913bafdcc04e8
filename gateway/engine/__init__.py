"""The gateway's side of the engine: admission, the client, the engine process, per-request streams and their text."""
