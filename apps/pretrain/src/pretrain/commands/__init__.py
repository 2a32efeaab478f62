"""One module per `pretrain` subcommand."""
