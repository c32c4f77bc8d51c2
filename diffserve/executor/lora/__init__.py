"""LoRA adapters: which are served and resident, and which version each running request holds
(``store``); each row of a batched forward given its own request's stack (``rows``, with the row
plan in ``row_plan`` and the gathered method's weights in ``gathered``). Imports PEFT (only where
adapters are served) and the lower rooms."""
