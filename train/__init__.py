"""Training pipeline of the drafters (optional extra `train`: torch, CPU). Never imported by engine/ or ninfer_tui/."""
