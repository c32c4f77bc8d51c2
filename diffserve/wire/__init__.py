"""What the processes say to each other, torch-free (the frontend and the scheduler import it): the
messages and their frames (``protocol``), a request as the engines see it and the work an executor
is handed (``request``), how each request field takes part in batching (``roles``), what a request
asks the engine to do (``tasks``), its samples' bookkeeping (``samples``) and cost (``costs``), a
rollout's answer (``rollouts``), what an executor says of its model (``model_info``), and the
online-RL loop's weight commands with their tensor transport (``weight_commands``,
``shared_tensors``)."""
