"""Worker supervision: one owner task per vLLM server, with a state machine nobody else changes."""
