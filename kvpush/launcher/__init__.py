"""Starting deployments: `kvpush up` (up.py), server processes and free ports (launch.py), CPU
pinning (placement.py), and P and D in two network namespaces over a shaped link (netlink.py)."""
