"""`dflash-local tui`: chat with a model pair and watch DFlash work, live (entry point: app.run)."""
