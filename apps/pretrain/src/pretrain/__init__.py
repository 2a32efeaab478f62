"""pretrain: the trainer and CLI that compose the par packages."""
