"""Parallel groups, one executor spread over several ranks: a rank's view of its group and its
collectives (``topology``), the model parallelised with diffusers' own parallelism and what a
model cannot do in a group (``model``), the leader and its followers kept in step (``ranks``), and
which errors are the group's own (``failures``). May import the families and the lower rooms."""
