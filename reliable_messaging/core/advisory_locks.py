"""The PostgreSQL advisory locks the app takes, in one place so that none collide: a class,
then a purpose or a key's hash."""

# The class of the app-wide locks, then each one's purpose.
ADVISORY_CLASS = 0x726D  # "rm"
UPKEEP_LOCK = 1  # the partitions' upkeep, one run at a time
GROUP_FOLD_LOCK = 2  # one fold of the failure groups' deltas at a time
# The class of the inbox claim's per-key locks (the key is a hash of consumer and message_id).
CLAIM_LOCK_CLASS = 0x726D0001
# The class of publish()'s lock per idempotency key (a hash of the key).
IDEMPOTENCY_LOCK_CLASS = 0x726D0002
