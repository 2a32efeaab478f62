"""Starting and ending the ranks: the launchers, each rank's environment and placement, pre-flight checks, locks, pre-emption and hangs."""
