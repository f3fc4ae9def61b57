"""Turning a stored model config into a checked engine command: its flags, argv, memory check and vLLM's verdict."""
