"""The parallel layout (`layout`), the rules it must obey (`rules`) and its process groups (`groups`)."""
