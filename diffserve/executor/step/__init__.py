"""The step engine: running sets of requests that join and leave between denoising steps
(``engine``: one step planned, then executed; ``planner``: the plan; ``lifecycle``: who is held
and every change of it; ``admission``: a work item made a unit; ``units``: the records;
``set_inputs``: a running set's stacked inputs; ``stages`` and ``stage_work``: encoding and
decoding beside the loop; ``timer``: a step's device time; ``prompt_cache``; ``rollout``: the
rollouts' stochastic sampler). May import every room below it."""
