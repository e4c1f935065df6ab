"""Byte transport shared by plugins: Mooncake Transfer Engine (:mod:`.mooncake`), keeping its
listeners on the job's address (:mod:`.bind_guard`), and message authentication with a job
secret (:mod:`.auth`). Imported lazily by the plugins that move bytes; nothing here runs at
activation."""
