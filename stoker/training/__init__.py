"""A consumer: its model replica, optimizer, precision, averaging and the group its replicas meet in."""
