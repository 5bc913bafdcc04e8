"""What a client meets before any handler: connection and frame limits, API keys and origins, token rates."""
