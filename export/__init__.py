"""llgraph.export"""
