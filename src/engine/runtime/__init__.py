"""Process life around training: who launched this process, rendezvous, stop signals, dead ranks, exit.

The strategies (:mod:`src.engine.strategies`) call into this room; nothing here is a Lightning strategy.
"""
