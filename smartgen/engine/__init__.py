"""The transfer engine: layout, plans and policies, masks, pools, descriptors, index ops and kernels, the prefill and decode sides, metrics. Imports no model, serving, CLI, TUI or store code."""
