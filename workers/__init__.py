"""workers: the model runtime — models behind their seams, decoding, scheduler, engine, the Worker
server, hot-swap and isolation."""
