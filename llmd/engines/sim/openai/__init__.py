"""vLLM 0.32's OpenAI wire format for the simulated engine, pure (no sockets, no clocks except `created`): errors,
field reads, request parsing, chat messages, validation against the model, response and chunk building."""
