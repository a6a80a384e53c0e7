"""Graph rewrites: functionalize buffer updates, initial state, quantized delegated state."""
