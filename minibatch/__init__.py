"""minibatch: a compact LLM inference engine and a course on dynamic batching."""
