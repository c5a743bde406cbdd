"""The cluster: the one live session, its lifecycle, recovery, watchdog, devices and nanny reaping."""
