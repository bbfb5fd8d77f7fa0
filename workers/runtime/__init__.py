"""The processes that run a job, on top of the rest of workers: Ray actors (a supervisor per job, a
thin actor per rank), the untrusted child each rank trains in (sandbox, child, rank_child, ranks),
Ray tasks whose work runs in such a child (isolated), the rendezvous, output capture, placement
groups and node probes (cluster), and the zygote that starts children with torch loaded.

May import: workers.
"""
