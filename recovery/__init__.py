"""In-rank recovery: interrupt, rebuild communicators, plan and run the restore, DCP fallback."""
