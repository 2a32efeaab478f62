"""Starting and ending the ranks: the launchers, each rank's environment and placement, locks, safe run files, pre-emption and hangs."""
