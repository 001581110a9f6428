"""The emulator: a stand-in for a vLLM P/D deployment with bidirectional KV transfer."""
