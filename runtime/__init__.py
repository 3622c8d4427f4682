"""llgraph.runtime"""
