"""ControlNet: the control models served beside the model, loaded and checked against its family
(``models``), and each step's control work on the rows that use them: every model once a step,
its residuals scaled per row and zero outside a row's window (``rows``). What a family declares
for it is in ``families/control_hooks``. May import the families and the lower rooms."""
