"""The adaptive controller: pure math (acceptance, cost, latency, policy search) and the
controller actor that applies it. The math modules import neither Ray nor vLLM."""
