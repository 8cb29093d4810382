"""Example rayfed_proto plug-in: its modules register themselves when their entry points load."""
