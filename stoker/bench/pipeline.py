"""`stoker bench pipeline`: placeholder replaced below."""
