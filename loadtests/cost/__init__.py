"""The cost budget: the work per request counted deterministically, through the whole gateway in
one process (`harness`), against the budgets CI enforces (`budget`)."""
