"""Prompts several real-stack test modules send."""

# Prompt lookup predicts its greedy continuation well: speculation gets drafts accepted.
REPETITIVE = "one two three four five six, one two three four five six, one two three four"
# One repetitive, one factual, one code prompt: acceptance differs between them.
PROMPTS = [REPETITIVE, "The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
# Greedy decoding continues this one by repeating its sentence: prompt lookup's chain4 would
# take 4.2 tokens a step over 96 tokens of transformers' greedy output.
LOOPING = "The cat sat on the mat. " * 6
# Greedy decoding with ignore_eos drifts into repetition, which n-gram drafting predicts
# moderately well (1.4 tokens a chain4 step): speculation pays for one sequence and costs at a
# large batch.
STORY = "Write a short story about a cat who learns to fly."
