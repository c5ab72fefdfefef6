"""A consumer: its device feed, model replica, optimizer, precision, averaging and the group its replicas meet in."""
