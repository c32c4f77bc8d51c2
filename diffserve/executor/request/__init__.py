"""Request mode: one batched call of the loaded pipeline (or of its task's pipeline) per batch
(``runner``). May import the step engine (rollouts run through it) and the rooms below."""
