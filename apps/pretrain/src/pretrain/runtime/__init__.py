"""Starting and ending the ranks: the launchers, each rank's environment and placement, pre-flight checks, locks, safe run files, pre-emption and hangs."""
