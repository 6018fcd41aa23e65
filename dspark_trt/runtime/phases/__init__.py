"""The phases of one runtime step, in the order the step runs them: admission (queue, slots, prompts
held for a shared prefill call), depth planning, drafting, verify planning, verification, commit,
learning. Each is a small object; results travel between them as named tuples."""
