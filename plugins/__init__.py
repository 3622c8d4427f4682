"""llgraph.plugins"""
