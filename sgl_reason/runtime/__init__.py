"""The SGLang runtime side of sgl-reason: CPU compatibility, launcher, embedded server, plugin.

Nothing in the programs layer imports this package's internals; it talks HTTP to the server.
"""
