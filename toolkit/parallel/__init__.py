"""The parallel layout (`layout`), the rules it must obey (`rules`), its process groups (`groups`) and DeepSpeed's view of them (`mpu`)."""
